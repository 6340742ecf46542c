"""What ships as ``auto``: the suite's candidates judged on real steps against ``torch``
(:mod:`autoscale.build.suite_eval`), the RL candidates trained for it
(:mod:`autoscale.build.agents`), and the build that picks, checks and exports
(:mod:`autoscale.build.auto`). The bar itself is :mod:`autoscale.training.bar`, the one the
search's no-harm check uses too."""

from autoscale.build.auto import AutoBuild, BuildResult, BuildSettings, choose

__all__ = ["AutoBuild", "BuildResult", "BuildSettings", "choose"]
