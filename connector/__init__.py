"""Engine-facing API (scheduler side and worker side) over a Store or the daemon's client."""
