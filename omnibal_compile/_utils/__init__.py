"""Private helpers shared by every layer: checks of user input, byte sizes, tables, label conventions."""
