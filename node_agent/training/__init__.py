"""Training jobs on this node: discovery, hang and straggler signals, the verdict and its state."""
