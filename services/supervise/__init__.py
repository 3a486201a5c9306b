"""The run engine: plan a run's processes, check its inputs, launch, watch and restart them."""
