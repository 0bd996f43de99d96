"""What the engine tells about itself: events, snapshots, audit, replay, traces."""
