"""The daemon: cadence, XID watch, Prometheus metrics, sd_notify and its action thread."""
