"""Texts for speculative decoding's tests and benchmark: a ~480-token passage to summarise or
proofread (a *grounded* task, whose answer repeats its context), and an open-ended one."""

from __future__ import annotations

PASSAGE = """The lighthouse at Carrow Point was built in 1871 to guard the narrow channel between the mainland and the island of Tessa. Before it stood, ships bound for the harbour at Millbrook had to pass the reef at night with nothing but the lights of the fishing village to guide them, and in the winter of 1868 three vessels were lost there in a single storm. The harbour board asked the engineer Margaret Halloway to design a tower that could stand on the bare rock at the end of the point, where the waves broke highest.

Halloway chose granite from the quarry at Glenhead, cut into interlocking blocks so that each course was keyed to the one below it. The blocks were shaped on the mainland, numbered, and carried out to the point by boat when the sea was calm enough to land them. Work could only go on during the summer months, and in the first year the masons managed just four courses before the autumn gales closed the site. The tower was finished in the third summer. It is forty-one metres tall, and its light, first lit with oil and later with electricity, can be seen from twenty-two nautical miles away on a clear night.

For almost a century the light was kept by three keepers who lived in the cottages at the foot of the tower. They worked in shifts through the night, winding the clockwork that turned the lens every hour, trimming the wicks, and writing the weather in the logbook at midnight and at four in the morning. Supplies came by boat every two weeks, but in bad winters the keepers sometimes went a month without seeing anyone from the mainland. The logbooks, now kept in the museum at Millbrook, record storms, shipwrecks, the births of children in the cottages, and one visit from a king.

The light was automated in 1968. The keepers left, the cottages were sold, and the lens was replaced by a smaller electric lamp that is checked twice a year by engineers from the harbour board. In 2004 a group of volunteers formed the Carrow Point Trust, restored the cottages, and opened the tower to visitors in the summer. Today about twelve thousand people climb the one hundred and fifty-four steps every year to see the view across the channel to Tessa, and the original lens is on display in the old oil store at the foot of the tower."""

SUMMARISE = "Summarise the following text in a few paragraphs.\n\n" + PASSAGE
PROOFREAD = (
    "Proofread the following text and return it in full with any mistakes corrected.\n\n" + PASSAGE
)
STORY = "Write a long story about a girl who finds a door at the bottom of her garden."
