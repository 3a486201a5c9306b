"""The records and names that processes exchange through the queue, owned by neither party.

* :mod:`.names`: partitions, record fields, consumer tasks, the teacher logits' transports;
* :mod:`.teacher`: a trainer's request for teacher logits and the teacher's result;
* :mod:`.end_of_data`: the collators' end-of-data marker;
* :mod:`.incarnation`: the teachers' announcements (which one serves a group now);
* :mod:`.rollout`: the rollout workers' on-policy samples.

Each name below is importable from the package as well; a module is imported when one of its
names is first asked for, so that the names (which a settings module reads) never import torch.
"""

from __future__ import annotations

from xtoken_core.lazy import lazy_names

# name -> the module of this package that defines it
_HOMES = {
    **dict.fromkeys(("EOF_KEY", "eof_fields", "eof_samples", "put_eof"), "end_of_data"),
    **dict.fromkeys(("announce_teacher", "teacher_incarnations"), "incarnation"),
    **dict.fromkeys(
        (
            "QUEUE_TRANSPORTS",
            "ROLLOUT_TASK",
            "TEACHER_TASK",
            "TRANSPORTS",
            "hidden_field",
            "meta_partition",
            "new_instance",
            "policy_dir",
            "request_partition",
            "result_field",
            "rollout_partition",
            "topk_fields",
            "trainer_task",
        ),
        "names",
    ),
    **dict.fromkeys(
        ("ROLLOUT_FIELDS", "is_rollout_sample", "rollout_key", "rollout_values"), "rollout"
    ),
    **dict.fromkeys(
        (
            "MAX_BLOB_BYTES",
            "POSITIONS_FIELD",
            "REQUEST_FIELDS",
            "Request",
            "Result",
            "decode_request",
            "hidden_column",
            "hidden_from_column",
            "pack_blob",
            "request_fields",
            "topk_columns",
            "topk_from_columns",
            "unpack_blob",
        ),
        "teacher",
    ),
}


__all__ = [
    "EOF_KEY",
    "MAX_BLOB_BYTES",
    "POSITIONS_FIELD",
    "QUEUE_TRANSPORTS",
    "REQUEST_FIELDS",
    "ROLLOUT_FIELDS",
    "ROLLOUT_TASK",
    "TEACHER_TASK",
    "TRANSPORTS",
    "Request",
    "Result",
    "announce_teacher",
    "decode_request",
    "eof_fields",
    "eof_samples",
    "hidden_column",
    "hidden_field",
    "hidden_from_column",
    "is_rollout_sample",
    "meta_partition",
    "new_instance",
    "pack_blob",
    "policy_dir",
    "put_eof",
    "request_fields",
    "request_partition",
    "result_field",
    "rollout_key",
    "rollout_partition",
    "rollout_values",
    "teacher_incarnations",
    "topk_columns",
    "topk_fields",
    "topk_from_columns",
    "trainer_task",
    "unpack_blob",
]

__getattr__, __dir__ = lazy_names(
    __name__, {name: f"{__name__}.{home}" for name, home in _HOMES.items()}
)
