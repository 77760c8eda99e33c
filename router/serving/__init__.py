"""Serving one client request: the RouterService, its runs and choices, the backend seam, request metrics."""
