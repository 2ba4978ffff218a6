"""Where GEMMs and copies run: the compute devices, the burn engine, the all-reduce rank."""
