"""The wire contract (kvstore.proto). Python stubs are generated under kvstore/, not here."""
