"""REST routes of the control plane (one module per resource)."""
