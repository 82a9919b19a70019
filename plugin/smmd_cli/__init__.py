"""The small command-line helpers that every package's tools share, kept out of any one package so that
none climbs into another for them: ``options`` (a tool's command line as a frozen dataclass) and
``tables`` (the one Markdown table printer). Needs nothing but the standard library."""
