"""Operating the cluster through the router: the roles and scale API, drain, admin guard."""
