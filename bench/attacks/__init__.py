"""The attacks of ``kvbench attack`` (bench/attack.py), one module each, run against a target
daemon (target.py) by client processes (worker.py) where a client must die for real."""
