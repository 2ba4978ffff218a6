"""From results to a grade: rules, SKU baselines and the XID catalog."""
