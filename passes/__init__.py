"""The passes: one module per pass, each a frozen dataclass registered with
`shardc.passmanager.register_pass`. The pass manager imports every module here on first
lookup, so a new pass needs no list to be added to. Passes never import a backend.
"""
