"""``autoscale report``: one self-contained HTML page on a recorded run.

What the scale did against the gradients and fp16's range, what it cost (skipped steps, gradient
elements lost below fp16's range), the loss, what every built-in rule and ``auto`` would have
done on the same steps (a replay, with its limits said), and findings in plain words.
"""

from autoscale.report.findings import Finding, findings
from autoscale.report.page import write_report
from autoscale.report.replay import Outcome, RecordReplay

__all__ = ["Finding", "Outcome", "RecordReplay", "findings", "write_report"]
