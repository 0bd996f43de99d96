"""kvscope: a live inspector for paged KV caches (PySide6 + pyqtgraph over ``engine``)."""

__version__ = "0.1.0"
