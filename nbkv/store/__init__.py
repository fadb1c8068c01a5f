"""What outlives a slot: saves, restores and the parking lot.

The save format (content-addressed blobs, checksummed manifests), save and restore
over the engines' public state API, parked conversations in RAM and on disk, autosave.
"""
