"""Routing: pure policies, the prefix index, admission, and the P/D cluster backend that calls the workers."""
