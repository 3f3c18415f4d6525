"""A run resolved once: recipe + world size + environment -> the run plan, before any process starts.

* :mod:`.resolver` - :func:`resolve_run`, every pre-launch check, all problems at once.
* :mod:`.plan` - :class:`RunPlan` (what ``train.run.build`` constructs from; ``fbt train --dry-run``
  prints it), :class:`PlanError`, :class:`Environment`.
* :mod:`.sft` - the rules of a ``task: sft`` recipe.
"""
