"""What ships as ``auto``: the suite's candidates judged on real steps against ``torch``
(:mod:`autoscale.selection.suite_eval`), the RL candidates trained for it
(:mod:`autoscale.selection.agents`), and the build that picks, checks and exports
(:mod:`autoscale.selection.auto`). The bar itself is :mod:`autoscale.training.bar`, the one the
search's no-harm check uses too."""

from autoscale.selection.auto import AutoBuild, BuildResult, BuildSettings, what_ships

__all__ = ["AutoBuild", "BuildResult", "BuildSettings", "what_ships"]
