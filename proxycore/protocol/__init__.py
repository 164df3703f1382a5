"""The sans-IO middle stratum of the data plane: parsers, policy and decisions.

Nothing here awaits, opens a socket or imports trio (tests/test_architecture.py enforces it):
every module takes bytes or parsed values and returns decisions, so each can be fuzzed and
tested without a network.
"""
