"""The WRN track: the model, the image data, the recipe, the trainer and the accountant's peak of a WRN step
under any configuration of the levers. Imports the techniques and the accountant."""
