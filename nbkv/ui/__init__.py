"""What people see: words, colours, figures, static pages and the live widgets.

Everything here observes engines through their events and public snapshots.
"""
