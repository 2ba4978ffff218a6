"""Checks: one module (or one folder) per check, each ``run(ctx: CheckContext) ->
list[Result]``, registered in :mod:`node_agent.checking.registry`. A check never exits the
process and never imports pynvml; a check that cannot run returns ``skip`` results that
say why. What checks are handed and share is in :mod:`node_agent.checking`."""
