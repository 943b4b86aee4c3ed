"""Side tools over profiles: back-of-envelope estimates, budgets (`fxacct check`) and diffs of two profiles."""
