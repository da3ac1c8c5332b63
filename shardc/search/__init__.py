"""Strategy search: choose the mesh and the per-op strategies with the simulator as the oracle.

See docs/search.md. Entry point: `shardc.search.driver.search_plan`; `@shardc.auto(search=...)` calls it.
"""
