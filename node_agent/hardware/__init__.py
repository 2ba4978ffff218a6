"""What the node's hardware should be: SKU descriptions (GPUs, links, HCAs, minima) and the
driver's line catalog; read by the checks, the simulator and the grader alike."""
