"""Earlier names of the sources (``kvscope.sources``), kept for scripts and tests written against them."""
from .sources.base import StepRecord
from .sources.live import LiveSource as Session
from .sources.live import StepHook
from .sources.replay import ReplaySource as ReplaySession
from .sources.summary import Summary

__all__ = ["ReplaySession", "Session", "StepHook", "StepRecord", "Summary"]
