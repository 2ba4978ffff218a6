"""What checks are made of: the context a check is handed (``context``: ``CheckContext``;
``ports``), the registry (``registry``), a check's typed parameters (``params``), what it
declares for service (``behaviour``), and the parts several checks share. The checks
themselves are in :mod:`node_agent.checks`."""
