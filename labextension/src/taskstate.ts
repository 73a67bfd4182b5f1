/** What a task's events say about its state (docs/protocol.md, "Task states and events"). */

import type { TaskState } from './types';

export const TERMINAL_STATES: ReadonlySet<string> = new Set([
  'completed',
  'failed',
  'cancelled'
]);

const RESPONSE_EVENT_STATES: Readonly<Record<string, TaskState>> = {
  'response.created': 'queued',
  'response.queued': 'queued',
  'response.loading': 'loading',
  'response.in_progress': 'running',
  'response.cancelling': 'cancelling',
  'response.completed': 'completed',
  'response.incomplete': 'completed',
  'response.failed': 'failed',
  'response.cancelled': 'cancelled'
};

const TASK_EVENT_STATES: Readonly<Record<string, TaskState>> = {
  created: 'queued',
  queued: 'queued',
  loading: 'loading',
  in_progress: 'running',
  running: 'running',
  cancelling: 'cancelling',
  completed: 'completed',
  failed: 'failed',
  cancelled: 'cancelled'
};

/** The task state an event moves the task to, or null for an event that is no transition. */
export function stateAfterEvent(type: string): TaskState | null {
  const fromResponse = RESPONSE_EVENT_STATES[type];
  if (fromResponse) {
    return fromResponse;
  }
  if (type.startsWith('task.')) {
    return TASK_EVENT_STATES[type.slice('task.'.length)] ?? null;
  }
  return null;
}

/** The last event of a task's log: nothing follows it. */
export function isTerminalEvent(type: string): boolean {
  const state = stateAfterEvent(type);
  return state !== null && TERMINAL_STATES.has(state);
}

export function isTerminal(state: string): boolean {
  return TERMINAL_STATES.has(state);
}
