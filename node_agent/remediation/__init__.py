"""From a grade to actions: the plan, the guards, the executor, evidence and the durable store."""
