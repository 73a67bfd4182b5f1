/**
 * A model registration as its task's events tell it (issue 39): the stage it is at
 * (downloading, converting, hashing), how far, and for a download from the hub its bytes,
 * files and rate; then its outcome, the model registered or the error.
 *
 * The sidebar follows every unfinished task through its event stream (`model.ts`); each
 * event of a registration task goes through `registrationAfter`, and the Models section
 * (`views/registrations.tsx`) shows the result. The event types are the generated wire
 * types (`types.ts`), so a field the server renames fails the type check here.
 */

import { size } from './format';
import type { ITaskEvent } from './types';

/** How a registration ended. */
export type RegistrationOutcome =
  | { kind: 'registered'; model: string }
  | { kind: 'failed' | 'cancelled'; message: string };

/** What the sidebar knows of one registration, from its events so far. */
export interface IRegistration {
  /** The last `task.progress` stage (null: none seen yet). */
  stage: string | null;
  /** How far that stage is, 0–1. */
  fraction: number | null;
  /** A download's figures: kept once the download is done, while its files are hashed. */
  bytesDone: number | null;
  bytesTotal: number | null;
  filesDone: number | null;
  filesTotal: number | null;
  bytesPerSecond: number | null;
  outcome: RegistrationOutcome | null;
}

const EMPTY: IRegistration = {
  stage: null,
  fraction: null,
  bytesDone: null,
  bytesTotal: null,
  filesDone: null,
  filesTotal: null,
  bytesPerSecond: null,
  outcome: null
};

/** The registration after `event` (a fresh object when the event changes it; the same one,
 * or null, when it says nothing about it). */
export function registrationAfter(
  current: IRegistration | null,
  event: ITaskEvent
): IRegistration | null {
  const base = current ?? EMPTY;
  switch (event.type) {
    case 'task.progress': {
      const next: IRegistration = { ...base, stage: event.stage, fraction: event.fraction };
      // Only a download's events carry these (null in other stages'); the hashing that
      // follows keeps the download's figures. Events stored before the server wrote the nulls
      // leave them out, hence `typeof` and `?? null`.
      if (typeof event.bytes_total === 'number') {
        next.bytesDone = event.bytes_done ?? null;
        next.bytesTotal = event.bytes_total;
        next.filesDone = event.files_done ?? null;
        next.filesTotal = event.files_total ?? null;
        next.bytesPerSecond = event.bytes_per_second ?? null;
      }
      return next;
    }
    case 'task.completed': {
      const model = (event.result?.model as { id?: unknown } | undefined)?.id;
      return {
        ...base,
        outcome: { kind: 'registered', model: typeof model === 'string' ? model : '' }
      };
    }
    case 'task.failed':
    case 'task.cancelled':
      return {
        ...base,
        outcome: {
          kind: event.type === 'task.failed' ? 'failed' : 'cancelled',
          message: event.error
            ? `${event.error.message} (${event.error.code})`
            : event.type === 'task.failed'
              ? 'failed'
              : 'cancelled'
        }
      };
    default:
      return current;
  }
}

/** A registration's figures as the sidebar writes them. */
export interface IRegistrationText {
  /** "42%" (null: no progress seen). */
  percent: string | null;
  /** "13.4 MB of 32.0 MB" (a download). */
  bytes: string | null;
  /** "1/3 files" (a download). */
  files: string | null;
  /** "5.2 MB/s" (a download, while it runs). */
  rate: string | null;
}

export function registrationText(r: IRegistration): IRegistrationText {
  const downloading = r.stage === 'downloading';
  return {
    percent: r.fraction === null ? null : `${Math.floor(r.fraction * 100)}%`,
    bytes: r.bytesTotal === null ? null : `${size(r.bytesDone ?? 0)} of ${size(r.bytesTotal)}`,
    files: r.filesTotal === null ? null : `${r.filesDone ?? 0}/${r.filesTotal} files`,
    // The rate is this attempt's average so far: shown only while it downloads.
    rate:
      downloading && r.outcome === null && r.bytesPerSecond !== null
        ? `${size(r.bytesPerSecond)}/s`
        : null
  };
}
