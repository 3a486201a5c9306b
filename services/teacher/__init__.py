"""teacher."""
