/** Run an async job again soon after each call, never two at once, and never more than once
 * more however many calls arrive while it runs: the Activity section re-reads the metrics on
 * each task transition of the lifecycle stream this way, so its queue line ("N waiting, M
 * running") changes with the task rows instead of at the next periodic refresh. */

export class Coalesced {
  private running: Promise<void> | null = null;
  private again = false;

  constructor(private readonly job: () => Promise<void>) {}

  /** Start the job, or, if it runs already, run it once more when it ends. */
  request(): void {
    if (this.running !== null) {
      this.again = true;
      return;
    }
    this.running = (async () => {
      try {
        this.again = false;
        do {
          await this.job();
        } while (this.takeAgain());
      } finally {
        this.running = null;
      }
    })();
  }

  /** Whether a call came while the job ran (and forget it). */
  private takeAgain(): boolean {
    const again = this.again;
    this.again = false;
    return again;
  }
}
