/**
 * The sidebar's live view of the service's Prometheus metrics (GET /lmsp/v1/metrics, docs/
 * metrics.md): the exposition is parsed, a few figures kept over the last minutes, and the
 * throughput and time to first token of each interval between two scrapes computed from them.
 */

/** One sample: its metric name, labels and value. */
export interface ISample {
  name: string;
  labels: Record<string, string>;
  value: number;
}

const SAMPLE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

/** The samples of a Prometheus text exposition (comments and blank lines skipped). */
export function parseExposition(text: string): ISample[] {
  const out: ISample[] = [];
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) {
      continue;
    }
    const match = SAMPLE.exec(line);
    if (!match || match[1] === undefined || match[3] === undefined) {
      continue;
    }
    const labels: Record<string, string> = {};
    for (const [, key, raw] of (match[2] ?? '').matchAll(LABEL)) {
      if (key === undefined || raw === undefined) {
        continue;
      }
      labels[key] = raw.replace(/\\(.)/g, (_, c: string) => (c === 'n' ? '\n' : c));
    }
    out.push({ name: match[1], labels, value: Number(match[3]) });
  }
  return out;
}

/** The sum of a metric's samples whose labels include `where`. */
export function total(
  samples: ISample[],
  name: string,
  where: Record<string, string> = {}
): number {
  let sum = 0;
  for (const s of samples) {
    if (s.name === name && Object.entries(where).every(([k, v]) => s.labels[k] === v)) {
      sum += s.value;
    }
  }
  return sum;
}

/** What one scrape said, as the view keeps it. */
export interface IScrape {
  /** When it was read (ms since the epoch). */
  at: number;
  outputTokens: number;
  ttftSum: number;
  ttftCount: number;
  queueDepth: number;
  active: number;
}

export function scrapeOf(samples: ISample[], at: number): IScrape {
  return {
    at,
    outputTokens: total(samples, 'lmsp_output_tokens_total'),
    ttftSum: total(samples, 'lmsp_time_to_first_token_seconds_sum'),
    ttftCount: total(samples, 'lmsp_time_to_first_token_seconds_count'),
    queueDepth: total(samples, 'lmsp_queue_depth'),
    active: total(samples, 'lmsp_active_generations')
  };
}

/** One interval between two scrapes: tokens per second, and the mean time to first token of
 * the generations that got their first token in it (null: none did). */
export interface IPoint {
  at: number;
  tokensPerSecond: number;
  ttft: number | null;
}

export function pointsOf(history: IScrape[]): IPoint[] {
  const out: IPoint[] = [];
  for (let i = 1; i < history.length; i++) {
    const a = history[i - 1];
    const b = history[i];
    if (!a || !b) {
      continue;
    }
    const seconds = (b.at - a.at) / 1000;
    // A counter that went down: the server restarted between the two scrapes.
    if (seconds <= 0 || b.outputTokens < a.outputTokens || b.ttftCount < a.ttftCount) {
      continue;
    }
    const firsts = b.ttftCount - a.ttftCount;
    out.push({
      at: b.at,
      tokensPerSecond: (b.outputTokens - a.outputTokens) / seconds,
      ttft: firsts > 0 ? (b.ttftSum - a.ttftSum) / firsts : null
    });
  }
  return out;
}

/** What the last start-up recovered: (found state, policy, left in) → tasks. */
export interface IRecovered {
  previousState: string;
  policy: string;
  outcome: string;
  tasks: number;
}

export function startupRecovery(samples: ISample[]): IRecovered[] {
  return samples
    .filter(s => s.name === 'lmsp_recovered_tasks_total' && s.labels.cause === 'startup')
    .map(s => ({
      previousState: s.labels.previous_state ?? '',
      policy: s.labels.policy ?? '',
      outcome: s.labels.outcome ?? '',
      tasks: s.value
    }));
}
