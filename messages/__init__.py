"""Every message that crosses a service boundary, defined once (msgspec Structs)."""
