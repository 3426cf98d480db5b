"""What the daemon and its clients share: message conversion, bulk frames, the auth header,
the stats records, the heap settings. Imports nothing of the daemon or the Store."""
