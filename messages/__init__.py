"""Every message that crosses a service boundary, defined once (msgspec Structs).

Imports no service and no kernel.
"""
