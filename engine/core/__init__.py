"""Pure-Python bookkeeping: blocks, hashes, tables, requests, the scheduler."""
