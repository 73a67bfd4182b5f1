/**
 * Following a task's event log: `GET /lmsp/v1/tasks/{id}/events?stream=true` read with fetch
 * and a ReadableStream (through ServerConnection, so Jupyter authenticates it), resumed with
 * `Last-Event-ID` after a drop; the JSON page (`?after=N`) when a stream cannot be read.
 * Every event is delivered once, in sequence order, whatever the reconnects.
 */

import type { LMSPClient } from './api';
import { LMSPError, errorFrom } from './api';
import { isTerminalEvent } from './taskstate';
import type { ILifecycleEvent, ITaskEvent } from './types';

export interface ISSEMessage {
  id: string | null;
  event: string;
  data: string;
}

/** An incremental parser of the `text/event-stream` format (WHATWG HTML, 9.2.6). */
export class SSEParser {
  private buffer = '';
  private data: string[] = [];
  private event = '';
  private id: string | null = null;

  /** Feed a chunk; returns the messages it completed. */
  push(chunk: string): ISSEMessage[] {
    this.buffer += chunk;
    const out: ISSEMessage[] = [];
    for (;;) {
      const match = /\r\n|\r|\n/.exec(this.buffer);
      if (!match) {
        break;
      }
      // A lone "\r" at the end may be the first half of "\r\n": wait for more.
      if (match[0] === '\r' && match.index === this.buffer.length - 1) {
        break;
      }
      const line = this.buffer.slice(0, match.index);
      this.buffer = this.buffer.slice(match.index + match[0].length);
      const message = this.line(line);
      if (message) {
        out.push(message);
      }
    }
    return out;
  }

  private line(line: string): ISSEMessage | null {
    if (line === '') {
      if (this.data.length === 0) {
        this.event = '';
        return null;
      }
      const message = { id: this.id, event: this.event || 'message', data: this.data.join('\n') };
      this.data = [];
      this.event = '';
      return message;
    }
    if (line.startsWith(':')) {
      return null; // a keep-alive comment
    }
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? '' : line.slice(colon + 1);
    if (value.startsWith(' ')) {
      value = value.slice(1);
    }
    if (field === 'data') {
      this.data.push(value);
    } else if (field === 'event') {
      this.event = value;
    } else if (field === 'id' && !value.includes('\0')) {
      this.id = value;
    }
    return null;
  }
}

/** `reconnecting`: the last attempt failed (the server is gone or restarting); retrying. */
export type FollowMode = 'stream' | 'poll' | 'idle' | 'reconnecting';

export interface IFollowOptions {
  client: LMSPClient;
  taskId: string;
  /** The last sequence number already seen (-1: from the start). */
  after: number;
  onEvent: (event: ITaskEvent) => void;
  onMode?: (mode: FollowMode) => void;
  /** Called once when the log ended (terminal event) or the task is gone. */
  onDone?: (reason: 'terminal' | 'gone' | 'stopped') => void;
  /** Poll interval of the fallback, ms. */
  pollInterval?: number;
}

/** Follows one task's event log until its terminal event or `stop()`. */
export class TaskFollower {
  private readonly abort = new AbortController();
  private after: number;
  private finished = false;
  private streamFailures = 0;

  constructor(private readonly options: IFollowOptions) {
    this.after = options.after;
  }

  get lastSequenceNumber(): number {
    return this.after;
  }

  /** Stopped by `stop()`, or the log ended. (A method: the state changes across awaits.) */
  isStopped(): boolean {
    return this.abort.signal.aborted || this.finished;
  }

  start(): this {
    void this.run();
    return this;
  }

  stop(): void {
    if (!this.abort.signal.aborted) {
      this.abort.abort();
      this.done('stopped');
    }
  }

  private done(reason: 'terminal' | 'gone' | 'stopped'): void {
    if (!this.finished) {
      this.finished = true;
      this.options.onMode?.('idle');
      this.options.onDone?.(reason);
    }
  }

  private deliver(event: ITaskEvent): void {
    if (event.sequence_number <= this.after || this.finished) {
      return; // seen already (a replay overlapping a reconnect)
    }
    this.after = event.sequence_number;
    this.options.onEvent(event);
    if (isTerminalEvent(event.type)) {
      this.done('terminal');
    }
  }

  private async run(): Promise<void> {
    while (!this.isStopped()) {
      try {
        // After repeated stream failures, make progress with a page, then try streaming again.
        const streamed = this.streamFailures < 3 ? await this.stream() : false;
        if (!streamed && !this.isStopped()) {
          await this.pollOnce();
          await sleep(this.options.pollInterval ?? 1000, this.abort.signal);
          this.streamFailures = Math.max(0, this.streamFailures - 1);
        }
      } catch (error) {
        if (this.abort.signal.aborted) {
          return;
        }
        if (error instanceof LMSPError && error.status === 404) {
          this.done('gone');
          return;
        }
        this.streamFailures += 1;
        this.options.onMode?.('reconnecting');
        await sleep(Math.min(5000, 250 * 2 ** this.streamFailures), this.abort.signal).catch(
          () => undefined
        );
      }
    }
  }

  /** One SSE connection; false when the response cannot be read as a stream. */
  private async stream(): Promise<boolean> {
    const headers: Record<string, string> = { Accept: 'text/event-stream' };
    if (this.after >= 0) {
      headers['Last-Event-ID'] = String(this.after);
    }
    const id = encodeURIComponent(this.options.taskId);
    const response = await this.options.client.fetch(
      `tasks/${id}/events?stream=true&starting_after=${this.after}`,
      { headers, signal: this.abort.signal, cache: 'no-store' }
    );
    if (!response.ok) {
      throw await errorFrom(response);
    }
    const body = response.body;
    if (!body || !(response.headers.get('Content-Type') ?? '').includes('text/event-stream')) {
      this.streamFailures = 3;
      return false;
    }
    this.options.onMode?.('stream');
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    const parser = new SSEParser();
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) {
          break;
        }
        for (const message of parser.push(value)) {
          this.deliver(JSON.parse(message.data) as ITaskEvent);
          this.streamFailures = 0;
        }
        if (this.finished) {
          break;
        }
      }
    } finally {
      reader.cancel().catch(() => undefined);
    }
    if (!this.finished) {
      // The server closed the stream before the end: reconnect from the last event.
      throw new Error('event stream closed early');
    }
    return true;
  }

  private async pollOnce(): Promise<void> {
    this.options.onMode?.('poll');
    let more = true;
    while (more && !this.isStopped()) {
      const page = await this.options.client.events(this.options.taskId, this.after);
      for (const event of page.data) {
        this.deliver(event);
      }
      more = page.has_more && page.data.length > 0;
    }
  }
}

export interface ILifecycleOptions {
  client: LMSPClient;
  /** Each transition of one of the caller's tasks, once, in commit order. */
  onEvent: (event: ILifecycleEvent) => void;
  /** The stream is (again) connected: transitions from now on arrive (list the tasks now,
   * once, to know where they all stand). */
  onOpen: () => void;
  /** The stream is lost (the caller polls meanwhile) or back. */
  onConnected?: (connected: boolean) => void;
}

/**
 * Follows `GET /lmsp/v1/lifecycle` (every task of the caller created, changing state, ending)
 * until `stop()`, reconnecting with `Last-Event-ID` after a drop, so no transition is missed
 * or delivered twice. Replaces polling `/tasks` while it is connected.
 */
export class LifecycleFollower {
  private readonly abort = new AbortController();
  private after: number | null = null;
  private failures = 0;

  constructor(private readonly options: ILifecycleOptions) {}

  start(): this {
    void this.run();
    return this;
  }

  stop(): void {
    this.abort.abort();
  }

  /** (A method: the state changes across awaits.) */
  isStopped(): boolean {
    return this.abort.signal.aborted;
  }

  private async run(): Promise<void> {
    while (!this.isStopped()) {
      try {
        await this.stream();
      } catch {
        if (this.isStopped()) {
          return;
        }
      }
      this.options.onConnected?.(false);
      this.failures += 1;
      await sleep(Math.min(10000, 250 * 2 ** this.failures), this.abort.signal).catch(
        () => undefined
      );
    }
  }

  private async stream(): Promise<void> {
    const headers: Record<string, string> = { Accept: 'text/event-stream' };
    if (this.after !== null) {
      headers['Last-Event-ID'] = String(this.after);
    }
    const response = await this.options.client.fetch('lifecycle', {
      headers,
      signal: this.abort.signal,
      cache: 'no-store'
    });
    if (!response.ok) {
      throw await errorFrom(response);
    }
    const body = response.body;
    if (!body) {
      throw new Error('the lifecycle stream has no body');
    }
    this.options.onConnected?.(true);
    if (this.after === null) {
      // From now on: where every task stands comes from one list.
      this.options.onOpen();
    }
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    const parser = new SSEParser();
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) {
          break;
        }
        for (const message of parser.push(value)) {
          const event = JSON.parse(message.data) as ILifecycleEvent;
          if (this.after !== null && event.sequence_number <= this.after) {
            continue;
          }
          this.after = event.sequence_number;
          this.failures = 0;
          this.options.onEvent(event);
        }
      }
    } finally {
      reader.cancel().catch(() => undefined);
    }
    // Closed by the server. (With nothing received yet, the reconnect starts from "now"
    // again and lists the tasks again: nothing is missed either way.)
  }
}

/** Wait `ms`, or reject when `signal` aborts. */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(new Error('aborted'));
      return;
    }
    const timer = setTimeout(() => {
      signal?.removeEventListener('abort', onAbort);
      resolve();
    }, ms);
    const onAbort = (): void => {
      clearTimeout(timer);
      reject(new Error('aborted'));
    };
    signal?.addEventListener('abort', onAbort, { once: true });
  });
}
