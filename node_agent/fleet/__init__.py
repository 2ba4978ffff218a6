"""Many nodes' reports: outliers, stragglers and hung jobs, and the fleet's HTML page."""
