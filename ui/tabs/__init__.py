"""One module per tab of the page; each `build(...)` lays out its tab and wires its own events."""
