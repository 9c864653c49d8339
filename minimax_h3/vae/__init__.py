"""The video and audio VAEs and the video decode tiling."""
