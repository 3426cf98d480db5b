"""What the daemon and its clients share: message conversion, bulk frames, the auth header.
Imports nothing of the daemon or the Store."""
