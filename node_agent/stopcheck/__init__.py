"""Stop-time checks across the nodes of a stopped job: one rank per node, name the bad machine."""
