"""The node-agent command line: the parser and one module per command."""
