"""One module per table or figure of the study, for both tracks: what the notebooks call. Imports the tracks."""
