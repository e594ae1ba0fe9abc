"""Presentation: what people read. HTML reports and SVG charts (shared by the report and the studio) and terminal tables; no logic beyond layout."""
