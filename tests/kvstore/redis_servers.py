"""The old import path of :mod:`tests.support.redis_servers`, kept only because bench/remote.py
and bench/vllm_connector.py still import it from here (tests never do). Delete once they import
``tests.support.redis_servers``."""

from tests.support.redis_servers import Cluster, Proxy, Server, free_port, wait_for

__all__ = ["Cluster", "Proxy", "Server", "free_port", "wait_for"]
