"""Protocol buffer contracts (``*.proto``) and their generated Python stubs."""
