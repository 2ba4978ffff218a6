"""The daemon: cadence, the checks' watchers, Prometheus metrics, sd_notify and its action thread."""
