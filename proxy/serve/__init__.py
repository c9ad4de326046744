"""Wires it all and runs it: the only package that may import every other.

Owns: the command line (`cli`, which chooses one process or N workers), the one build of a serving
process (`process`), the one-process proxy (`app`), the supervisor and its workers (`workers`),
what crosses between them (`messages`) and what they share in memory (`shared`), what both use
around them (`wiring`), the admin listener (`admin`), its page (`admin_page`) and its reader
processes (`admin_reads`), and `demo`. Nothing below it knows which runner runs.

Must not import: nothing is below it that it may not use; nothing imports it but `__main__`.
"""
