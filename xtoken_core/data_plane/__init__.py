"""Data plane helpers: the jagged <-> padded codec (``codec``), TensorDicts <-> queue fields
(``tensordict_io``) and fast access to ``torch.jagged`` nested tensors (``njt``)."""
