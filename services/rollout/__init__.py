"""rollout: a copy of the student samples on-policy continuations for the trainer."""
