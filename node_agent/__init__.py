"""node-agent: decides whether a GPU training node is fit for service, and acts when not."""

__version__ = "0.1.0"
